"""Serving engine: cache pools, scheduler, fixed-shape jitted steps, on-device sampling, offline API."""
