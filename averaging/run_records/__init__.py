"""A training run's records in the DHT (progress, user metrics, the trainers' directory):
their format and the pure rules over them, read by the wrappers and by the daemon alike."""
