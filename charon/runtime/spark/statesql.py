"""SQL over state: an operator's state as a Spark DataFrame at one consistent epoch, read from the durable copy.

Schema of :func:`state_frame` (one row per stored value of the operator):

==============  =========  ==========================================================================
column          type       meaning
==============  =========  ==========================================================================
``key``         string     the entity key
``item``        string     ``""`` for the entity's main value, else the named item
``value``       inferred   the decoded value: bigint if every value is an integer, double if numbers,
                           boolean, string if strings; otherwise the value as JSON text
``value_json``  string     the decoded value as JSON text (always)
``epoch``       bigint     the epoch the whole frame reflects (one consistent cut)
==============  =========  ==========================================================================

Each partition's durable copy (Arrow base + deltas, :class:`charon.state.durable.DurableState`) is read by one
Spark task, so the read runs in parallel on the executors and never waits for (or stalls) the running
query: it reads files the epochs already wrote. The Spark runtime can show every epoch since the durable
copy's base; an in-process node's data directory the epochs it checkpointed (``retained_epochs``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import msgspec

from charon import serde
from charon.core.routing import split_store_key
from charon.runtime.control import EpochNotRetained, node_retained_epochs
from charon.runtime.sqlstate import SQLRejected, SQLSyntaxError, SQLTimeout
from charon.state.durable import DurableState, DurableStateError

__all__ = ["state_frame", "layout_of", "register_views", "DataDirLayout", "safe_sql", "SQLRejected", "SQLSyntaxError",
           "SQLTimeout"]


class DataDirLayout(msgspec.Struct):
    """Where a data directory keeps its durable state: root, partitions, newest consistent epoch, engine."""

    root: str
    partitions: int
    epoch: int
    engine: str
    retained: list[int] | None = None  # node: the readable epochs (None: every epoch since the base)


def _newest_record(epochs_dir: str) -> int:
    """The newest epoch with a record under ``epochs_dir`` (-1: none)."""
    names = os.listdir(epochs_dir) if os.path.isdir(epochs_dir) else []
    return max((int(n.split(".")[0]) for n in names if n.endswith(".msgpack")), default=-1)


def layout_of(data_dir: str) -> DataDirLayout:
    """Inspect a data directory of either runtime (``charon run --data-dir``; it may be in use)."""
    from charon.runtime.spark.runtime import read_layout

    ckpt = os.path.join(data_dir, "checkpoint")
    spark = read_layout(ckpt)
    if spark is not None:  # a rescale names its state directory
        return DataDirLayout(os.path.join(ckpt, spark.state), spark.partitions,
                             _newest_record(os.path.join(ckpt, "epochs")), "spark")
    node = os.path.join(data_dir, "node.json")
    if os.path.isfile(node):
        with open(node) as f:
            layout = json.load(f)
        parts = int(layout["partitions"])
        root = os.path.join(data_dir, layout.get("state", "state"))  # a rescaled node names its state directory
        retained = node_retained_epochs(DurableState(root, fsync=False), parts)
        epoch = _newest_record(os.path.join(data_dir, "epochs"))
        return DataDirLayout(root, parts, epoch, "inprocess", retained + ([epoch] if epoch not in retained else []))
    raise FileNotFoundError(f"{data_dir} holds no Charon deployment (no checkpoint/layout.json, no node.json)")


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if -(1 << 63) <= v < (1 << 63) else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"


def _read_partition(root: str, epoch: int, operator: str | None, pids: Iterator[int]) -> Iterator[tuple]:
    durable = DurableState(root, fsync=False)
    for pid in pids:
        try:
            state, _ = durable.load(pid, epoch)
        except DurableStateError as exc:
            raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None
        for k, raw in state.items():
            op, key, item = split_store_key(k)
            if operator is not None and op != operator:
                continue
            v = serde.decode(raw)
            yield (op, key, item.lstrip("\x01"), v, _kind(v))


_VALUE_TYPES = {"int": "bigint", "float": "double", "bool": "boolean", "str": "string"}


def _value_type(kinds: set[str]) -> str:
    if not kinds:
        return "bigint"
    if kinds == {"int"}:
        return "int"
    if kinds <= {"int", "float"}:
        return "float"
    if len(kinds) == 1 and kinds <= {"bool", "str"}:
        return next(iter(kinds))
    return "json"


def _frame(spark: Any, layout: DataDirLayout, epoch: int, operator: str | None) -> Any:
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    if epoch > layout.epoch or epoch < -1:
        raise EpochNotRetained(f"epoch {epoch} is not committed (the newest is {layout.epoch})")
    if layout.retained is not None and epoch not in layout.retained and epoch != -1:
        raise EpochNotRetained(f"epoch {epoch} is not retained (retained: {layout.retained[-20:]})")
    root, n = layout.root, layout.partitions
    rdd = spark.sparkContext.parallelize(range(n), n).mapPartitions(
        lambda it: _read_partition(root, epoch, operator, it)
    )
    kinds = set(rdd.map(lambda r: r[4]).distinct().collect())  # a first pass picks the value column's type
    vt = _value_type(kinds)
    spark_type = {"int": LongType(), "float": DoubleType(), "bool": BooleanType(), "str": StringType(),
                  "json": StringType()}[vt]

    def row(r: tuple) -> tuple:
        op, key, item, v, _ = r
        text = json.dumps(v, sort_keys=True, default=repr)
        value = text if vt == "json" else (float(v) if vt == "float" else v)
        return (op, key, item, value, text, epoch)

    schema = StructType([
        StructField("operator", StringType(), False), StructField("key", StringType(), False),
        StructField("item", StringType(), False), StructField("value", spark_type, True),
        StructField("value_json", StringType(), False), StructField("epoch", LongType(), False),
    ])
    return spark.createDataFrame(rdd.map(row), schema)


def state_frame(spark: Any, layout: DataDirLayout, operator: str, epoch: int | None = None) -> Any:
    """``operator``'s state as of ``epoch`` (default: the newest) as a DataFrame (see the module docstring)."""
    df = _frame(spark, layout, layout.epoch if epoch is None else epoch, operator)
    return df.drop("operator")


def register_views(spark: Any, layout: DataDirLayout, epoch: int | None = None) -> dict[str, Any]:
    """A temporary view per operator found in the state (``SELECT ... FROM <operator>``), at one epoch."""
    at = layout.epoch if epoch is None else epoch
    ops = sorted(_frame(spark, layout, at, None).select("operator").distinct().toPandas()["operator"])
    views = {}
    for op in ops:
        df = state_frame(spark, layout, op, at)
        df.createOrReplaceTempView(op)
        views[op] = df
    return views


# -- the dashboard's SQL box: a safe subset, checked on Spark's parsed and analyzed plans ------------------------
#: Logical plan nodes a query may contain (parsed plan): one SELECT over the state views, with joins,
#: set operations, grouping, ordering and limits. Everything else (commands, DDL/DML, CTEs, table-valued
#: functions, file or catalog relations, IDENTIFIER(...) clauses, hints, scripts) is refused.
ALLOWED_PLANS = frozenset({
    "Project", "Filter", "Aggregate", "Sort", "GlobalLimit", "LocalLimit", "Offset", "Distinct", "Deduplicate",
    "SubqueryAlias", "UnresolvedRelation", "Join", "Union", "Intersect", "Except", "OneRowRelation",
    "UnresolvedSubqueryColumnAliases", "Window", "UnresolvedHaving", "UnresolvedInlineTable",
    "RepartitionByExpression",
})
#: Expression nodes a query may contain (parsed plan): columns, literals, operators, CASE/CAST/IN/LIKE,
#: subqueries (their plans are checked the same way) and calls of :data:`ALLOWED_FUNCTIONS`.
ALLOWED_EXPRESSIONS = frozenset({
    "UnresolvedAttribute", "UnresolvedStar", "UnresolvedAlias", "Alias", "Literal", "UnresolvedFunction",
    "UnresolvedExtractValue", "UnresolvedRegex", "UnresolvedOrdinal", "UnresolvedSeed", "SortOrder",
    "Add", "Subtract", "Multiply", "Divide", "Remainder", "UnaryMinus", "UnaryPositive", "IntegralDivide", "Pmod",
    "EqualTo", "EqualNullSafe", "LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual", "Not",
    "And", "Or", "In", "InSubquery", "IsNull", "IsNotNull", "Like", "ILike", "LikeAny", "NotLikeAny", "RLike",
    "CaseWhen", "If", "Cast", "Coalesce", "Concat", "Between", "Exists", "ScalarSubquery", "ListQuery",
    "UnresolvedWindowExpression", "WindowExpression", "WindowSpecDefinition", "SpecifiedWindowFrame",
    "UnspecifiedFrame", "UnspecifiedFrame$", "RowFrame", "RangeFrame", "UnboundedPreceding$",
    "UnboundedFollowing$", "CurrentRow$",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "MultiAlias", "UnresolvedNamedLambdaVariable",
    "LambdaFunction",
})
#: Functions a query may call (case-insensitive): aggregates, arithmetic, strings, JSON, conditionals.
#: No reflection (``reflect``/``java_method``), no files (``input_file_name``, ``read_files``), no UDFs.
ALLOWED_FUNCTIONS = frozenset({
    "sum", "count", "avg", "mean", "min", "max", "stddev", "stddev_samp", "stddev_pop", "variance", "var_samp",
    "var_pop", "count_if", "approx_count_distinct", "percentile", "percentile_approx", "median", "first", "last",
    "any_value", "collect_list", "collect_set", "bool_and", "bool_or", "every", "some", "any", "max_by",
    "min_by", "abs", "round", "bround", "floor", "ceil", "ceiling", "sqrt", "pow", "power", "exp", "ln", "log",
    "log10", "log2", "sign", "signum", "greatest", "least", "mod", "pmod", "lower", "upper", "lcase", "ucase",
    "length", "char_length", "character_length", "substr", "substring", "left", "right", "trim", "ltrim",
    "rtrim", "concat", "concat_ws", "replace", "split", "split_part", "startswith", "endswith", "contains",
    "instr", "locate", "format_number", "regexp_extract", "regexp_replace", "regexp_like",
    "get_json_object", "json_tuple", "from_json", "to_json", "coalesce", "nvl", "nvl2", "ifnull", "nullif",
    "if", "isnull", "isnotnull", "cast", "try_cast", "int", "bigint", "double", "string", "boolean", "size",
    "array_contains", "element_at", "row_number", "rank", "dense_rank", "lag", "lead", "ntile",
    "hash", "md5", "sha1", "sha2", "struct", "array", "map",
})
#: Leaves an analyzed plan may read: the state views' rows (built from the durable copy) and constants.
ALLOWED_LEAVES = frozenset({"LogicalRDD", "OneRowRelation"})
#: Expression classes refused anywhere in the analyzed plan (a second line behind the allow-lists above).
DENIED_EXPRESSIONS = frozenset({
    "CallMethodViaReflection", "StaticInvoke", "Invoke", "NewInstance", "ScalaUDF", "PythonUDF", "ScalaUDAF",
    "HiveGenericUDF", "HiveSimpleUDF", "InputFileName", "InputFileBlockStart", "InputFileBlockLength",
    "CurrentDatabase", "CurrentCatalog", "CurrentUser", "Uuid", "Rand", "Randn", "SparkPartitionID",
    "MonotonicallyIncreasingID", "AssertTrue", "RaiseError", "SparkVersion", "TypeOf",
})


def _seq(obj: Any) -> list[Any]:
    """A Scala ``Seq`` (py4j) as a list."""
    return [obj.apply(i) for i in range(obj.size())]


def _name(obj: Any) -> str:
    return str(obj.getClass().getSimpleName())


def referenced_views(spark: Any, sql: str, views: set[str]) -> set[str]:
    """Check ``sql`` on Spark's parsed plan and return the state views it reads (lower-case names).

    Raises :class:`SQLSyntaxError` when it does not parse, :class:`SQLRejected` for anything outside the safe
    subset: a node or expression not in :data:`ALLOWED_PLANS`/:data:`ALLOWED_EXPRESSIONS`, a function not in
    :data:`ALLOWED_FUNCTIONS`, a relation that is not one of ``views`` (no catalog, file or qualified names)."""
    jss = spark._jsparkSession
    try:
        plan = jss.sessionState().sqlParser().parsePlan(sql)
    except Exception as exc:  # noqa: BLE001 - py4j's wrapper of Spark's ParseException
        raise SQLSyntaxError(_first_line(exc)) from None
    wanted = {v.lower() for v in views}
    used: set[str] = set()
    budget = [10_000]  # nodes visited: a bound on the checker's own work

    def plan_node(node: Any) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise SQLRejected("the query is too large")
        name = _name(node)
        if name not in ALLOWED_PLANS:
            raise SQLRejected(f"only a single SELECT over the state views is allowed (found {name})")
        if name == "UnresolvedRelation":
            parts = [str(p) for p in _seq(node.multipartIdentifier())]
            if len(parts) != 1 or parts[0].lower() not in wanted:
                raise SQLRejected(f"unknown relation {'.'.join(parts)!r}: the state views are {sorted(views)}")
            used.add(parts[0].lower())
        for e in _seq(node.expressions()):
            expr(e)
        for c in _seq(node.children()):
            plan_node(c)

    def expr(e: Any) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise SQLRejected("the query is too large")
        name = _name(e)
        if name not in ALLOWED_EXPRESSIONS:
            raise SQLRejected(f"expression {name} is not allowed")
        if name == "UnresolvedFunction":
            fn = ".".join(str(p) for p in _seq(e.nameParts())).lower()
            if fn not in ALLOWED_FUNCTIONS:
                raise SQLRejected(f"function {fn}() is not allowed")
        if name in ("Exists", "ScalarSubquery", "ListQuery", "InSubquery"):
            sub = e.query() if name == "InSubquery" else e.plan()
            if name == "InSubquery":
                expr(sub)
            else:
                plan_node(sub)
        for c in _seq(e.children()):
            expr(c)

    plan_node(plan)
    return used


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("py4j", "at ", "JVM stacktrace")):
            return line[:500]
    return type(exc).__name__


def check_analyzed(df: Any) -> None:
    """The analyzed plan reads only :data:`ALLOWED_LEAVES` and holds no :data:`DENIED_EXPRESSIONS`."""
    budget = [20_000]

    def walk(node: Any) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise SQLRejected("the query is too large")
        children = _seq(node.children())
        if not children and _name(node) not in ALLOWED_LEAVES:
            raise SQLRejected(f"the query reads {_name(node)}, not a state view")
        for e in _seq(node.expressions()):
            walk_expr(e)
        for c in children:
            walk(c)

    def walk_expr(e: Any) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise SQLRejected("the query is too large")
        if _name(e) in DENIED_EXPRESSIONS:
            raise SQLRejected(f"expression {_name(e)} is not allowed")
        with contextlib.suppress(Exception):  # a subquery expression: its plan too
            if hasattr(e, "plan") and _name(e) in ("ScalarSubquery", "Exists", "ListQuery"):
                walk(e.plan())
        for c in _seq(e.children()):
            walk_expr(c)

    walk(df._jdf.queryExecution().analyzed())


def _cell(v: Any) -> Any:
    """A result cell as JSON: numbers, strings, booleans, null; decimals and times as text, bytes as hex."""
    import datetime
    import decimal
    import math

    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, datetime.date | datetime.datetime):
        return v.isoformat()
    if isinstance(v, bytes | bytearray):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): _cell(x) for k, x in v.items()}
    if hasattr(v, "asDict"):
        return {k: _cell(x) for k, x in v.asDict().items()}
    if isinstance(v, list | tuple):
        return [_cell(x) for x in v]
    return str(v)


def safe_sql(
    spark: Any, layout: DataDirLayout, views: list[str], sql: str, epoch: int | None = None, max_rows: int = 1000,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run one safe SELECT over the state views (an operator's :func:`state_frame`) at one consistent epoch.

    Checked first on the parsed plan (:func:`referenced_views`), then on the analyzed one
    (:func:`check_analyzed`), in a session of its own whose only relations are the views the query names.
    At most ``max_rows`` rows (``truncated`` says if there were more); the Spark jobs are cancelled after
    ``timeout_s`` (:class:`SQLTimeout`). Returns ``{"epoch", "columns", "rows", "truncated", "engine"}``."""
    import threading
    import uuid

    at = layout.epoch if epoch is None else epoch
    used = referenced_views(spark, sql, set(views))
    session = spark.newSession()  # its own temporary views: nothing else is visible by name
    by_lower = {v.lower(): v for v in views}
    sc = spark.sparkContext
    group = f"charon-sql-{uuid.uuid4().hex}"
    expired = threading.Event()
    done = threading.Event()

    def expire() -> None:  # again and again: a job the query starts after the deadline is cancelled too
        expired.set()
        while not done.is_set():
            with contextlib.suppress(Exception):
                sc.cancelJobGroup(group)
            done.wait(0.2)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    sc.setJobGroup(group, "charon sql (admin)", interruptOnCancel=True)
    timer.start()
    try:
        for v in used:
            state_frame(session, layout, by_lower[v], at).createOrReplaceTempView(v)
        try:
            df = session.sql(sql)
        except Exception as exc:  # noqa: BLE001 - an AnalysisException (unknown column, types)
            raise SQLSyntaxError(_first_line(exc)) from None
        check_analyzed(df)
        try:
            rows = df.limit(max_rows + 1).collect()
        except Exception as exc:  # noqa: BLE001 - cancelled, or a runtime error of the query (ANSI casts)
            if expired.is_set():
                raise SQLTimeout(f"the query ran longer than {timeout_s:g} s and was cancelled") from None
            raise SQLRejected(f"the query failed: {_first_line(exc)}") from None
    except Exception:
        if expired.is_set():
            raise SQLTimeout(f"the query ran longer than {timeout_s:g} s and was cancelled") from None
        raise
    finally:
        done.set()
        timer.cancel()
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    return {"epoch": at, "columns": list(df.columns), "rows": [[_cell(x) for x in r] for r in rows[:max_rows]],
            "truncated": len(rows) > max_rows, "engine": "spark"}
