"""The verify-and-draft step's own operations ("plugins"): pure-PyTorch references here, their Triton kernels with
launchers and dispatchers in `nextn.plugins.kernels`."""
