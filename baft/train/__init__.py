"""Trainer: mesh setup, stages and schedule, deterministic resumable data, the training loop."""
