"""What a run tells: counters, report.json, the terminal, HTML, progress."""
