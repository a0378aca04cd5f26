"""Whatever a client sends, gymsim answers with a deliberate status, never a 500."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymsim.testing import GymsimInstance, default_instance_config

OPS = ["prepare", "renew", "commit", "resume", "restore", "retire", "forget"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["checkpoint_id", "deadline_ts", "checkpoint_dir", "episode_ids", "rollout_ids", "stop", "extra"]
)
bodies = st.dictionaries(field_names, json_values, max_size=5) | json_values


def test_random_control_and_data_bodies_never_give_500():
    gym = GymsimInstance.start(default_instance_config(turn_seconds=0.0))
    headers = {"Authorization": f"Bearer {gym.token}"}
    try:
        with httpx.Client(timeout=10) as client:

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
            @given(op=st.sampled_from(OPS), body=bodies, server=st.sampled_from(["policy_model", "workplace_agent"]))
            def control(op, body, server):
                response = client.post(f"{gym.servers[server]}/ng-control/v1/checkpoint/{op}", json=body, headers=headers)
                assert response.status_code in (200, 409, 422), (op, body, response.status_code, response.text)

            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
            @given(body=bodies, path=st.sampled_from(["workplace_agent/run", "calendar_resources/sessions/s1/mutate"]))
            def data(body, path):
                response = client.post(f"{gym.base_url}/s/{path}", json=body)
                assert response.status_code in (200, 400, 409, 422), (path, body, response.status_code, response.text)

            control()
            data()
    finally:
        gym.stop()
