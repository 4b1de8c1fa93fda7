"""Capacity planning: offline models that size a deployment before it is built (`kvgate plan ...`)."""
