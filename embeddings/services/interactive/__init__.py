"""The interactive door: work someone waits for, on the interactive lane. Uploads embedded and
stored within the request's deadline (:mod:`.upload`), searches by a text, an image or a stored
image (:mod:`.search`) or by several positive and negative examples (:mod:`.examples`), vectors
on demand (:mod:`.embed`), and beneath them the wait for a chain's last result until the deadline
(:mod:`.waiting`). The web sends the work through ``embeddings.dispatch`` and never loads the model.
"""
