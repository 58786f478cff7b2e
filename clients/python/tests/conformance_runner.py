"""Runs one conformance scenario (conformance/scenarios/*.json) against real servers with this
client. The format is described in conformance/README.md; each `op_*` method below is one
entry of its vocabulary and returns the result object that the step's `expect` is matched
against.

A scenario also runs against a new three-node cluster that replicates its queues
(`run_scenario(path, cluster_entry)`), talking to one of its nodes, when it can: one server,
and no op of `NOT_ON_A_CLUSTER` (exactly the Rust runner's rule, crates/levee/tests/conformance.rs).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from typing import Any, Dict, List, Optional

import levee
from levee.errors import ERROR_CLASSES, make_error
from levee.v1 import hotkey_pb2, topic_pb2

from cluster_support import SHARDS as CLUSTER_SHARDS
from cluster_support import wait_settled
from support import LeveeServer, start_replicated_cluster

REPOSITORY = pathlib.Path(__file__).resolve().parents[3]
SCENARIOS = REPOSITORY / "conformance" / "scenarios"

MATCH_KINDS = {
    "exact": hotkey_pb2.MATCH_KIND_EXACT,
    "prefix": hotkey_pb2.MATCH_KIND_PREFIX,
    "default": hotkey_pb2.MATCH_KIND_DEFAULT,
}
MATCH_NAMES = {value: name for name, value in MATCH_KINDS.items()}
SOURCES = {
    hotkey_pb2.HOT_KEY_SOURCE_UNSPECIFIED: "UNSPECIFIED",
    hotkey_pb2.HOT_KEY_SOURCE_DETECTED: "DETECTED",
    hotkey_pb2.HOT_KEY_SOURCE_MANUAL: "MANUAL",
}
POLL_S = 0.01
NOT_ON_A_CLUSTER = ("stop_server", "start_server", "restart_server")
"""Ops a scenario run against a three-node cluster may not use: stopping or restarting its only
server (the cluster's other nodes would go on)."""
CLUSTER_NODES = 3


class ScenarioFailure(AssertionError):
    pass


def load(path: pathlib.Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


def runs_on_a_cluster(scenario: Dict[str, Any]) -> bool:
    """Whether `scenario` also runs against a three-node cluster: one server, and no op of
    `NOT_ON_A_CLUSTER`."""
    return int(scenario.get("servers", 1)) == 1 and all(
        step["op"] not in NOT_ON_A_CLUSTER for step in scenario["steps"]
    )


def to_bytes(value: Any) -> bytes:
    """A scenario's bytes: text as UTF-8, {"hex": ...}, or {"repeat": s, "times": n}."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict) and "hex" in value:
        return bytes.fromhex(value["hex"])
    if isinstance(value, dict) and "repeat" in value:
        return value["repeat"].encode("utf-8") * int(value["times"])
    raise ScenarioFailure(f"not a bytes value: {value!r}")


def from_bytes(value: bytes) -> Any:
    """Bytes in a result: text when UTF-8 (and printable), else {"hex": ...}."""
    try:
        text = value.decode("utf-8")
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return {"hex": value.hex()}


def matches(expected: Any, actual: Any, path: str) -> Optional[str]:
    """None when `actual` meets `expected`, else why not."""
    if isinstance(expected, dict) and len(expected) == 1:
        (operator, operand), = expected.items()
        if operator == "at_least":
            return None if actual >= operand else f"{path}: {actual!r} is below {operand!r}"
        if operator == "at_most":
            return None if actual <= operand else f"{path}: {actual!r} is above {operand!r}"
        if operator == "contains":
            return None if operand in actual else f"{path}: {actual!r} lacks {operand!r}"
        if operator == "not_contains":
            return None if operand not in actual else f"{path}: {actual!r} has {operand!r}"
        if operator == "unordered":
            same = isinstance(actual, list) and sorted(map(json.dumps, actual)) == sorted(map(json.dumps, operand))
            return None if same else f"{path}: {actual!r} is not {operand!r} in some order"
        if operator == "length":
            return None if len(actual) == operand else f"{path}: length {len(actual)}, not {operand}"
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key, value in expected.items():
            if key not in actual:
                return f"{path}.{key}: missing from {actual!r}"
            problem = matches(value, actual[key], f"{path}.{key}")
            if problem:
                return problem
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return f"{path}: expected {expected!r}, got {actual!r}"
        for index, (want, got) in enumerate(zip(expected, actual)):
            problem = matches(want, got, f"{path}[{index}]")
            if problem:
                return problem
        return None
    return None if expected == actual else f"{path}: expected {expected!r}, got {actual!r}"


def lookup(result: Any, path: str) -> Any:
    for part in path.split("."):
        result = result[int(part)] if isinstance(result, list) else result[part]
    return result


class Runner:
    """One scenario's servers, clients and named streams."""

    def __init__(self, scenario: Dict[str, Any], cluster_entry: Optional[int] = None) -> None:
        self.scenario = scenario
        # Against a cluster: the index (0 to 2) of the node the scenario talks to as its server.
        self.cluster_entry = cluster_entry
        self.servers: List[LeveeServer] = []
        # Against a cluster: the nodes other than the one the scenario talks to.
        self.other_nodes: List[LeveeServer] = []
        self.clients: Dict[int, levee.Client] = {}
        self.variables: Dict[str, Any] = {}
        self.hot_keys: Dict[str, levee.HotKeys] = {}
        self.changes: Dict[str, List[Dict[str, Any]]] = {}
        self.members: Dict[str, Dict[str, Any]] = {}
        self.subscriptions: Dict[str, Dict[str, Any]] = {}
        self.many: Dict[str, levee.Mailboxes] = {}

    async def run(self) -> None:
        try:
            if self.cluster_entry is None:
                for _ in range(int(self.scenario.get("servers", 1))):
                    self.servers.append(LeveeServer(extra=self.scenario.get("server_args")).start())
            else:
                await self.start_cluster(self.cluster_entry)
            for number, step in enumerate(self.scenario["steps"], 1):
                await self.step(number, step)
        finally:
            await self.close()

    async def close(self) -> None:
        for hot_keys in self.hot_keys.values():
            hot_keys.close(timeout_s=1)
        for member in self.members.values():
            member["stream"].close()
        for subscription in self.subscriptions.values():
            await subscription["stream"].close()
        for mailboxes in self.many.values():
            await mailboxes.close()
        for client in self.clients.values():
            await client.close()
        for server in self.servers + self.other_nodes:
            server.cleanup()

    async def start_cluster(self, entry: int) -> None:
        """A three-node cluster replicating its queues over `CLUSTER_SHARDS` shards, every
        shard placed on the three nodes and led by its preferred replica, nothing changing;
        the scenario's server 0 is node `entry` + 1 (so some of its shards are led by the
        others, and its appends are forwarded)."""
        nodes = start_replicated_cluster(CLUSTER_NODES, CLUSTER_SHARDS)
        self.servers.append(nodes[entry])
        self.other_nodes.extend(node for index, node in enumerate(nodes) if index != entry)
        await wait_settled(nodes)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$var"}:
                return self.variables[value["$var"]]
            return {key: self.resolve(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item) for item in value]
        return value

    async def step(self, number: int, step: Dict[str, Any]) -> None:
        op = step["op"]
        args = self.resolve(step.get("args", {}))
        expect = self.resolve(step.get("expect", {}))
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise ScenarioFailure(f"step {number}: unknown op '{op}'")
        try:
            result = await handler(**args)
        except levee.LeveeError as error:
            if type(error) is not ERROR_CLASSES.get(error.code, levee.LeveeError):
                raise ScenarioFailure(f"step {number} ({op}): {error!r} is not the typed error of its code")
            result = {"error": error.code.reason, "code": int(error.code), "message": error.message}
        if "error" not in expect and "error" in (result or {}):
            raise ScenarioFailure(f"step {number} ({op}): unexpected error {result}")
        problem = matches(expect, result or {}, "result")
        if problem:
            raise ScenarioFailure(f"step {number} ({op} {json.dumps(args)[:300]}): {problem}; result {json.dumps(result)[:300]}")
        for name, path in step.get("save", {}).items():
            self.variables[name] = lookup(result, path)

    async def client(self, server: int = 0) -> levee.Client:
        if server not in self.clients:
            self.clients[server] = await levee.Client.connect(
                self.servers[server].grpc_addr, levee.ClientOptions(request_timeout_s=20)
            )
        return self.clients[server]

    # ---- servers and admin

    async def op_server_info(self, server: int = 0) -> Dict[str, Any]:
        info = await (await self.client(server)).server_info()
        return {"version": info.version, "grpc_addr": info.grpc_addr}

    async def op_stop_server(self, server: int = 0) -> Dict[str, Any]:
        self.servers[server].stop()
        return {}

    async def op_start_server(self, server: int = 0) -> Dict[str, Any]:
        self.servers[server].start(self.servers[server].grpc_addr)
        return {}

    async def op_restart_server(self, server: int = 0) -> Dict[str, Any]:
        self.servers[server].restart()
        return {}

    async def op_echo(self, payload: Any = "", delay_ms: int = 0, timeout_ms: int = 0,
                      server: int = 0) -> Dict[str, Any]:
        client = await self.client(server)
        if timeout_ms:
            client = levee.Client(client._channel, client.address,  # same channel, other deadline
                                  levee.ClientOptions(request_timeout_s=timeout_ms / 1000))
        echoed = await client.echo(to_bytes(payload), delay_ms)
        return {"payload": from_bytes(echoed)}

    async def op_sleep(self, ms: int) -> Dict[str, Any]:
        await asyncio.sleep(ms / 1000)
        return {}

    # ---- hot keys: admin

    async def op_set_rules(self, app: str, rules: List[Dict[str, Any]], server: int = 0) -> Dict[str, Any]:
        messages = [
            hotkey_pb2.HotKeyRule(
                match_kind=MATCH_KINDS[rule["match"]],
                key=to_bytes(rule.get("key", "")),
                window_ms=rule["window_ms"],
                threshold=rule["threshold"],
                hot_duration_ms=rule["hot_duration_ms"],
                description=rule.get("description", ""),
            )
            for rule in rules
        ]
        await (await self.client(server)).set_hot_key_rules(app, messages)
        return {}

    async def op_get_rules(self, app: str, server: int = 0) -> Dict[str, Any]:
        rules = await (await self.client(server)).hot_key_rules(app)
        return {"rules": [
            {"match": MATCH_NAMES.get(rule.match_kind, "unspecified"), "key": from_bytes(rule.key),
             "window_ms": rule.window_ms, "threshold": rule.threshold,
             "hot_duration_ms": rule.hot_duration_ms, "description": rule.description}
            for rule in rules]}

    async def op_set_hot_key(self, app: str, key: Any, duration_ms: int, server: int = 0) -> Dict[str, Any]:
        await (await self.client(server)).set_hot_key(app, to_bytes(key), duration_ms)
        return {}

    async def op_remove_hot_key(self, app: str, key: Any, server: int = 0) -> Dict[str, Any]:
        was_hot = await (await self.client(server)).remove_hot_key(app, to_bytes(key))
        return {"was_hot": was_hot}

    async def op_list_hot_keys(self, app: str, server: int = 0) -> Dict[str, Any]:
        events = await (await self.client(server)).hot_keys(app)
        return {"keys": [from_bytes(e.key) for e in events],
                "sources": [SOURCES[e.source] for e in events]}

    # ---- hot keys: the app-server client

    async def op_hotkeys_open(self, session: str, app: str, servers: Optional[List[int]] = None,
                              report_interval_ms: int = 20) -> Dict[str, Any]:
        indexes = servers if servers is not None else [0]
        options = levee.HotKeysOptions(
            app=app,
            servers=[self.servers[index].grpc_addr for index in indexes],
            report_interval_s=report_interval_ms / 1000,
            reconnect_backoff_min_s=0.05,
            reconnect_backoff_max_s=0.5,
            # The scenarios' servers are lone servers, each its own cluster: the list as given.
            follow_cluster=False,
        )
        hot_keys: levee.HotKeys = levee.HotKeys.start(options)
        self.hot_keys[session] = hot_keys
        observed: List[Dict[str, Any]] = []
        self.changes[session] = observed
        hot_keys.on_change(lambda change: observed.append(
            {"key": from_bytes(change.key), "hot": change.hot, "manual": change.manual}))
        connected = await self._until(lambda: hot_keys.stats().servers_connected == len(indexes), 10_000)
        return {"connected": connected}

    async def op_hotkeys_close(self, session: str) -> Dict[str, Any]:
        self.hot_keys.pop(session).close()
        return {}

    async def op_access(self, session: str, key: Any, times: int = 1) -> Dict[str, Any]:
        hot_keys = self.hot_keys[session]
        key_bytes = to_bytes(key)
        hot = False
        for _ in range(times):
            hot = hot_keys.is_hot(key_bytes)
        return {"hot": hot}

    async def op_flush(self, session: str) -> Dict[str, Any]:
        await asyncio.get_running_loop().run_in_executor(None, self.hot_keys[session].flush)
        return {}

    async def op_is_hot(self, session: str, key: Any) -> Dict[str, Any]:
        return {"hot": self.hot_keys[session].is_hot_now(to_bytes(key))}

    async def op_await_hot(self, session: str, key: Any, within_ms: int) -> Dict[str, Any]:
        hot_keys, key_bytes = self.hot_keys[session], to_bytes(key)
        return {"hot": await self._until(lambda: hot_keys.is_hot_now(key_bytes), within_ms)}

    async def op_await_cool(self, session: str, key: Any, within_ms: int) -> Dict[str, Any]:
        hot_keys, key_bytes = self.hot_keys[session], to_bytes(key)
        cooled = await self._until(lambda: not hot_keys.is_hot_now(key_bytes), within_ms)
        if cooled:
            # The hot set turns cool a moment before the change callbacks run: wait for this
            # cool change too, as the app would see it (bounded).
            wanted = from_bytes(key_bytes)
            await self._until(lambda: any(
                change["key"] == wanted and not change["hot"] for change in self.changes[session]
            ), 1_000)
        return {"hot": not cooled}

    async def op_await_connected(self, session: str, servers: int, within_ms: int) -> Dict[str, Any]:
        hot_keys = self.hot_keys[session]
        connected = await self._until(lambda: hot_keys.stats().servers_connected == servers, within_ms)
        return {"connected": connected}

    async def op_changes(self, session: str) -> Dict[str, Any]:
        return {"changes": list(self.changes[session])}

    async def op_hotkeys_stats(self, session: str) -> Dict[str, Any]:
        return dict(vars(self.hot_keys[session].stats()))

    async def op_server_of(self, session: str, key: Any) -> Dict[str, Any]:
        return {"server": self.hot_keys[session].server_of(to_bytes(key))}

    async def op_top_keys(self, app: str, limit: int = 10, server: int = 0) -> Dict[str, Any]:
        keys = await (await self.client(server)).top_keys(app, limit)
        return {"keys": [from_bytes(k.key) for k in keys], "counts": [k.count for k in keys]}

    # ---- queues

    async def op_append(self, queue: Any = None, payloads: Optional[List[Any]] = None,
                        messages: Optional[List[Dict[str, Any]]] = None, producer_id: str = "",
                        sequences: Optional[List[int]] = None, producer_name: str = "",
                        server: int = 0) -> Dict[str, Any]:
        if messages is None:
            messages = [{"queue": queue, "payload": payload} for payload in payloads or []]
            for message, sequence in zip(messages, sequences or []):
                message["sequence"] = sequence
        items = [levee.QueueMessage(to_bytes(m["queue"]), to_bytes(m["payload"]), m.get("sequence", 0))
                 for m in messages]
        client = await self.client(server)
        if producer_name:
            client = client.with_producer_name(producer_name)
        return {"offsets": await client.append_messages(items, producer_id)}

    async def op_read(self, queue: Any, offset: int = 0, max_messages: int = 0,
                      server: int = 0) -> Dict[str, Any]:
        response = await (await self.client(server)).read(to_bytes(queue), offset, max_messages)
        return {"payloads": [from_bytes(p) for p in response.payloads],
                "first_offset": response.first_offset, "next_offset": response.next_offset,
                "queue_next_offset": response.queue_next_offset}

    async def op_queue_info(self, queue: Any, server: int = 0) -> Dict[str, Any]:
        info = await (await self.client(server)).queue_info(to_bytes(queue))
        return {"first_offset": info.first_offset, "next_offset": info.next_offset}

    async def op_delete_queue(self, queue: Any, server: int = 0) -> Dict[str, Any]:
        return {"existed": await (await self.client(server)).delete_queue(to_bytes(queue))}

    async def op_set_producer_rate(self, producer_name: str, messages_per_s: float,
                                   server: int = 0) -> Dict[str, Any]:
        await (await self.client(server)).set_producer_rate(producer_name, messages_per_s)
        return {}

    async def op_produce(self, queue: Any, count: int, idempotent: bool = False,
                         server: int = 0) -> Dict[str, Any]:
        """The client's batching producer: `count` messages "0".."count-1", sent concurrently."""
        producer = levee.Producer(await self.client(server), levee.ProducerOptions(idempotent=idempotent))
        try:
            futures = [await producer.enqueue(to_bytes(queue), str(i).encode()) for i in range(count)]
            offsets = list(await asyncio.gather(*futures))
        finally:
            await producer.close()
        stats = producer.stats()
        return {"offsets_distinct": len(set(offsets)) == count, "first_offset": min(offsets),
                "last_offset": max(offsets), "messages_failed": stats.messages_failed}

    # ---- topics and groups

    async def op_create_topic(self, topic: str, partitions: int, server: int = 0) -> Dict[str, Any]:
        return {"existed": await (await self.client(server)).create_topic(topic, partitions)}

    async def op_partition_of(self, key: Any, partitions: int) -> Dict[str, Any]:
        return {"partition": levee.topic_partition(to_bytes(key), partitions)}

    async def op_publish(self, topic: str, messages: List[Dict[str, Any]], producer_id: str = "",
                         server: int = 0) -> Dict[str, Any]:
        records = [levee.Record(to_bytes(m.get("payload", "")), to_bytes(m.get("key", "")),
                                m.get("partition"), m.get("sequence", 0), m.get("delay_ms", 0))
                   for m in messages]
        published = await (await self.client(server)).publish(topic, records, producer_id)
        return {"partitions": [p.partition for p in published], "offsets": [p.offset for p in published]}

    async def op_describe_topic(self, topic: str, server: int = 0) -> Dict[str, Any]:
        described = await (await self.client(server)).describe_topic(topic)
        return {"next_offsets": [p.next_offset for p in described.partitions]}

    async def op_describe_group(self, group: str, topic: str, server: int = 0) -> Dict[str, Any]:
        described = await (await self.client(server)).describe_group(group, topic)
        return {"generation": described.generation,
                "members": sorted(m.member for m in described.members),
                "owners": [p.owner for p in described.partitions],
                "epochs": [p.epoch for p in described.partitions],
                "committed": [p.committed_offset for p in described.partitions]}

    async def op_member_join(self, member: str, topic: str, group: str, credit: int = 1000,
                             lease_ms: int = 10_000, within_ms: int = 5000,
                             server: int = 0) -> Dict[str, Any]:
        stream = await levee.MemberStream.open(await self.client(server), topic, group, member,
                                               credit, lease_ms)
        state: Dict[str, Any] = {"stream": stream, "deliveries": [], "assignments": [], "commit_results": []}
        self.members[member] = state
        state["reader"] = asyncio.ensure_future(self._read_member(state))
        return await self.op_member_await_assignment(member, within_ms)

    async def _read_member(self, state: Dict[str, Any]) -> None:
        try:
            while True:
                response = await state["stream"].read()
                if response is None:
                    raise make_error(levee.ErrorCode.UNAVAILABLE, "the consume stream closed")
                if response.HasField("assignment"):
                    state["assignments"].append(response.assignment)
                state["deliveries"].extend(response.deliveries)
                if response.commit_results:
                    state["commit_results"].append(list(response.commit_results))
        except levee.LeveeError as error:
            state["error"] = error

    def _member(self, member: str) -> Dict[str, Any]:
        state = self.members[member]
        return state

    async def op_member_await_assignment(self, member: str, within_ms: int = 5000) -> Dict[str, Any]:
        state = self._member(member)
        await self._until(lambda: state["assignments"] or "error" in state, within_ms)
        if not state["assignments"]:
            raise state.get("error") or ScenarioFailure(f"member {member}: no assignment")
        assignment = state["assignments"].pop(0)
        while state["assignments"]:  # only the latest counts
            assignment = state["assignments"].pop(0)
        return {"generation": assignment.generation,
                "partitions": [p.partition for p in assignment.partitions],
                "epochs": [p.epoch for p in assignment.partitions],
                "start_offsets": [p.start_offset for p in assignment.partitions]}

    async def op_member_receive(self, member: str, count: int, within_ms: int = 5000) -> Dict[str, Any]:
        state = self._member(member)
        await self._until(lambda: len(state["deliveries"]) >= count or "error" in state, within_ms)
        taken, state["deliveries"] = state["deliveries"][:count], state["deliveries"][count:]
        return {"partitions": [d.partition for d in taken], "offsets": [d.offset for d in taken],
                "epochs": [d.epoch for d in taken], "payloads": [from_bytes(d.payload) for d in taken]}

    async def op_member_commit(self, member: str, commits: List[Dict[str, Any]],
                               within_ms: int = 5000) -> Dict[str, Any]:
        state = self._member(member)
        await state["stream"].commit([
            topic_pb2.Commit(partition=c["partition"], epoch=c["epoch"], next_offset=c["next_offset"]) for c in commits])
        await self._until(lambda: state["commit_results"] or "error" in state, within_ms)
        if not state["commit_results"]:
            raise state.get("error") or ScenarioFailure(f"member {member}: no commit answer")
        results = state["commit_results"].pop(0)
        return {"codes": ["OK" if r.code == 0 else levee.ErrorCode(r.code).reason for r in results],
                "next_offsets": [r.next_offset for r in results]}

    async def op_member_heartbeat(self, member: str) -> Dict[str, Any]:
        await self._member(member)["stream"].heartbeat()
        return {}

    async def op_member_leave(self, member: str) -> Dict[str, Any]:
        # This side closes; once the server ended the stream the member has left.
        state = self.members.pop(member)
        await state["stream"].leave()
        try:
            await asyncio.wait_for(asyncio.shield(state["reader"]), 5)
        except asyncio.TimeoutError:
            state["stream"].close()
            state["reader"].cancel()
            raise AssertionError("the server did not end a left member's stream in 5 s")
        return {}

    async def op_member_status(self, member: str) -> Dict[str, Any]:
        state = self._member(member)
        error = state.get("error")
        return {"error": error.code.reason} if error else {"open": True}

    async def op_group_consume(self, topic: str, group: str, count: int, parallelism: int = 4,
                               ordered: bool = True, member: Optional[str] = None,
                               within_ms: int = 20_000, server: int = 0) -> Dict[str, Any]:
        """The client's GroupConsumer until `count` messages are handled; handlers of even
        offsets sleep longer than odd ones, so completions come out of order."""
        client = await self.client(server)
        consumer = levee.GroupConsumer(client, topic, group, levee.ConsumerOptions(
            member=member, parallelism=parallelism, ordered=ordered, commit_interval_s=0.02))
        seen: Dict[int, List[int]] = {}
        stop = asyncio.Event()
        running = 0
        most_running = 0

        async def handle(message: levee.Message) -> None:
            nonlocal running, most_running
            running += 1
            most_running = max(most_running, running)
            await asyncio.sleep(0.004 if message.offset % 2 == 0 else 0.001)
            seen.setdefault(message.partition, []).append(message.offset)
            running -= 1
            if sum(len(offsets) for offsets in seen.values()) >= count:
                stop.set()

        stats = await asyncio.wait_for(consumer.run(handle, stop), within_ms / 1000)
        in_order = all(offsets == sorted(offsets) for offsets in seen.values())
        return {"handled": stats.handled, "ordered_per_partition": in_order,
                "most_running_at_most_parallelism": most_running <= parallelism,
                "fenced_commits": stats.fenced_commits}

    # ---- mailboxes

    async def op_subscribe(self, subscription: str, queue: Any, consumer: str, credit: int = 100,
                           server: int = 0) -> Dict[str, Any]:
        stream = await (await self.client(server)).subscribe(to_bytes(queue), consumer, credit)
        self.subscriptions[subscription] = {"stream": stream}
        return {"start_offset": stream.start_offset}

    async def op_receive(self, subscription: str, count: int, within_ms: int = 5000) -> Dict[str, Any]:
        stream = self.subscriptions[subscription]["stream"]
        deadline = time.monotonic() + within_ms / 1000
        received: List[levee.Delivery] = []
        while len(received) < count:
            try:
                delivery = await asyncio.wait_for(stream.next(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                break
            if delivery is None:
                break
            received.append(delivery)
        return {"offsets": [d.offset for d in received], "payloads": [from_bytes(d.payload) for d in received]}

    async def op_ack(self, subscription: str, offset: int) -> Dict[str, Any]:
        await self.subscriptions[subscription]["stream"].ack(offset)
        return {}

    async def op_unsubscribe(self, subscription: str) -> Dict[str, Any]:
        await self.subscriptions.pop(subscription)["stream"].close()
        return {}

    # ---- many-queue mailboxes

    async def op_mailboxes_open(self, stream: str, consumer: str, credit: int = 1000,
                                server: int = 0) -> Dict[str, Any]:
        self.many[stream] = await (await self.client(server)).subscribe_many(consumer, credit)
        return {}

    async def op_mailboxes_add(self, stream: str, queues: List[Any]) -> Dict[str, Any]:
        numbers = await self.many[stream].add([to_bytes(queue) for queue in queues])
        return {"mailboxes": list(numbers)}

    async def op_mailboxes_receive(self, stream: str, count: int, within_ms: int = 5000) -> Dict[str, Any]:
        mailboxes = self.many[stream]
        deadline = time.monotonic() + within_ms / 1000
        received: List[levee.MailboxDelivery] = []
        while len(received) < count:
            try:
                delivery = await asyncio.wait_for(mailboxes.next(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                break
            if delivery is None:
                break
            received.append(delivery)
        return {"deliveries": [{"mailbox": d.mailbox, "offset": d.offset, "payload": from_bytes(d.payload)}
                               for d in received]}

    async def op_mailboxes_ack(self, stream: str, acks: List[Dict[str, int]]) -> Dict[str, Any]:
        mailboxes = self.many[stream]
        for ack in acks:
            mailboxes.ack(ack["mailbox"], ack["offset"])
        await mailboxes.flush_acks()
        return {}

    async def op_mailboxes_close(self, stream: str) -> Dict[str, Any]:
        await self.many.pop(stream).close()
        return {}

    # ---- helpers

    async def _until(self, condition: Any, within_ms: float) -> bool:
        deadline = time.monotonic() + within_ms / 1000
        while True:
            if condition():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)


def run_scenario(path: pathlib.Path, cluster_entry: Optional[int] = None) -> bool:
    """Runs the scenario at `path` against its own lone servers, or with `cluster_entry`
    against a new three-node cluster through node `cluster_entry` + 1; whether it ran (a
    scenario that cannot run on a cluster does not)."""
    scenario = load(path)
    if cluster_entry is not None and not runs_on_a_cluster(scenario):
        return False
    asyncio.run(Runner(scenario, cluster_entry).run())
    return True
