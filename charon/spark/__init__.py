"""Spark data plane: Python streaming data sources over Charon's logs (see :mod:`charon.spark.source`)."""
