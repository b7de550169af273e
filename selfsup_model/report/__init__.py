"""Reporting: metrics, paired effects, the comparison report and its plots."""
