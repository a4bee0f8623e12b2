"""The drafter families one capture serves: which target layers each reads, in every trainer's numbering."""
