"""The strategies of a shard's update: master weights, moments, where they live (offload) and the
split of a shard between host and device, and Muon for a tensor-parallel matrix. Imports nothing
but ``core`` and ``kernels``."""
