"""Pages for people: server-rendered Django templates over the same services and selectors as the
REST API (search, upload, jobs, one image), signed in with Django sessions, plus the thumbnail view
both the pages and the API link to. The pages never decode an image and never reach the model or
the vector store themselves: like the API they go through ``embeddings.services``.
"""
