"""Lane control: admission of interactive requests, the workers' reports it predicts from, and bulk
work that yields to the interactive lane, over one Redis client and its key names."""
