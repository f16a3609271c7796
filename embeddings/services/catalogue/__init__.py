"""The catalogue: where images come from (sources), the images and their bytes, bulk jobs, and
copies of the catalogue in another embedding space. Nothing here imports the model lifecycle or
the request-level services above it; work is sent through ``embeddings.dispatch``."""
