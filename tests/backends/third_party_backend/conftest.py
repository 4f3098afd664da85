# project/ is the third-party backend of docs/backends.md ("Writing your own backend"), laid out as
# its own package. Its tests run in a pytest of their own (test_third_party_backend.py), where
# an entry point registers the backend, not in this run.
collect_ignore = ["project"]
