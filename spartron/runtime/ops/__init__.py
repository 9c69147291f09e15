"""Runtime op boundaries (torch.library custom ops). Importing this package registers them."""
