"""Feature and training throughput: measure.py runs it, report.py writes its markdown."""
