"""Out-of-memory errors: is it one (classify), what its message says (parse), and why it happened with
what to do about it (diagnosis)."""
