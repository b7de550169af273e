"""The network: layers, the encoder and its heads, losses, optimisers, saving."""
