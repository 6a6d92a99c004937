"""Out-of-memory errors: what their message says (messages), and why one happened with what to do about it
(diagnosis, advice). Whether an error is one is decided below, in devices/errors.py."""
