"""Evaluation on AIME / MATH-500 style datasets (the command line: megatron_gtpo/evaluate.py): Mean@n and Pass@k
(passk.py), the report files (report.py), this rank's engine (replicas.py), generating and grading (run.py)."""
