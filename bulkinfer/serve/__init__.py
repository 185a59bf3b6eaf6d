"""``bulkinfer serve``: OpenAI's Files and Batch API over bulkinfer's own
core (:func:`bulkinfer.jobs.run.run`), state in SQLite under a data
directory. :mod:`~bulkinfer.serve.store` keeps files and batches,
:mod:`~bulkinfer.serve.worker` runs them one after another on one warm
engine, :mod:`~bulkinfer.serve.api` is the FastAPI app."""
