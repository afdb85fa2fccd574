"""A flat buffer's shard and its update: the sharded buffer, the master-weight and moment
strategies, Muon's whole-matrix packing, and the parameters' binding to the flat buffer."""
