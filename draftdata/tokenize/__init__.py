"""Step 3, tokenize: samples built token-exact with their loss mask, written to Parquet."""
