# client.py: the bank through the HTTP gateway (after quickstart_http.sh: alice has 40, bob 60)
from charon.client import Client

with Client("http://127.0.0.1:8000", token="s3cret") as c:
    assert c.invoke("account", "alice", "transfer", "bob", 30) == 10  # the return value
    r = c.invoke_result("account", "alice", "deposit", 5, request_id="dep-1")
    print(r.value, r.epoch, r.position)  # the reply with its place in the serial order
    assert c.invoke_result("account", "alice", "deposit", 5, request_id="dep-1").epoch == r.epoch  # a retry: once
    assert c.state("account", "alice") == 15
