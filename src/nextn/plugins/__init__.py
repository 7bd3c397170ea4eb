"""The verify-and-draft step's own operations ("plugins"): each a pure-PyTorch reference first, kernels later."""
