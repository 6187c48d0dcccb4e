"""Content-addressed cache of finished runs."""
