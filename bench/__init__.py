"""Side-by-side benchmark of alignkit against TRL 1.16 (`python -m bench --help`). Not part of the test suite."""
