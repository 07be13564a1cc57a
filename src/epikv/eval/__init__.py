"""Reasoning evaluation: datasets, prompts per protocol, grading, resumable records, executors and reports."""
