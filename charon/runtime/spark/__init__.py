"""Spark data plane: the Spark runtime, Python streaming data sources over Charon's logs
(:mod:`charon.runtime.spark.source`), a local standalone cluster and the Java finder. Part of the runtime
layer: same import rules as :mod:`charon.runtime`.
"""
