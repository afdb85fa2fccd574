"""The strategies of a shard's update: master weights, moments, where they live (offload) and the
split of a shard between host and device. Imports nothing but ``core`` and ``kernels``."""
