"""Keeps the suite's token caches out of the user's home: one folder for the session, inherited by
the ranks the tests launch."""

import os
import tempfile

os.environ.setdefault("TRAINER_CACHE", tempfile.mkdtemp(prefix="trainer-cache-"))
