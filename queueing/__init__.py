"""The interactive lane's queueing arithmetic: numbers in, numbers out.

No Django, Redis or Celery: :mod:`queueing.wait_model` predicts an admitted request's wait and
decides admission, :mod:`queueing.wait_ahead` learns the wait a refused request is told. The lane
control of the app (``embeddings.lane_control``) reads the lane's state and calls them; the load
replay (``benchmarks/load_replay.py``) runs them on a recorded run.
"""
