"""Transfer: classifiers, fine-tuning, baselines and the comparison protocol."""
