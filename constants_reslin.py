"""What the kernels take: the update rules, the backends and the head sizes.

kernels_reslin checks its arguments against these and configuration_reslin checks a config
against the same, so the two cannot drift. A module of its own with no imports, because the
remote-code loaders before transformers 5.10 copy only the files a loaded module imports
directly: the configuration can import this, not the kernels and all they import.
"""

UPDATE_RULES = ("delta", "additive")
BACKENDS = ("auto", "torch", "triton", "recurrent")
# The kernels keep a head's Dk x Dv state in fast memory; 256 is their limit.
MAX_HEAD_DIM = 256
# The chunked Triton kernels take head sizes in these multiples (kernels_reslin says why).
CHUNKED_HEAD_DIM_MULTIPLE = 16
