"""Small helpers every step uses: files written atomically, log lines, content hashes, SQLite, plot data."""
