"""Environment fingerprint and audit."""
