# with `.venv/bin/charon run bank:app --engine inprocess --token s3cret` serving on port 8000
curl -s -X POST localhost:8000/invoke/account/alice/deposit -H 'Authorization: Bearer s3cret' \
     -H 'Content-Type: application/json' -d '{"args": [100]}'
curl -s -X POST localhost:8000/invoke/account/alice/transfer -H 'Authorization: Bearer s3cret' \
     -H 'Content-Type: application/json' -H 'Idempotency-Key: t-1' -d '{"args": ["bob", 30]}'
# {"request_id":"t-1","tid":8,"epoch":1,"position":8,"value":70,"status":"committed"}   (tid/epoch/position vary)
curl -s localhost:8000/state/account/alice -H 'Authorization: Bearer s3cret'
.venv/bin/charon invoke account alice transfer '["bob", 30]' --url http://localhost:8000 --token s3cret
