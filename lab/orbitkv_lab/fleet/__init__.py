"""Deployment without a Docker engine: read the compose file, run its services as local processes."""
