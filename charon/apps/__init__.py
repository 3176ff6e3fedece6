"""Example and benchmark applications, written with Charon's public programming model only."""
