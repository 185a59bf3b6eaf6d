"""Reading input files and writing output files: formats, records, atomic publishing."""
