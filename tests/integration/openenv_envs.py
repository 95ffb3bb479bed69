"""An OpenEnv environment written for the tests, served as `tests.integration.openenv_envs:app`: it opens with
'Say something.', answers each turn with its length, rewards it by length / 50 and ends after two turns."""

from __future__ import annotations

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class SayAction(Action):
    message: str


class CountObservation(Observation):
    text: str = ""


class CountEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.turns = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> CountObservation:
        self.turns = 0
        return CountObservation(text="Say something.")

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> CountObservation:
        self.turns += 1
        return CountObservation(text=f"{len(action.message)} characters", reward=len(action.message) / 50,
                                done=self.turns >= 2)

    @property
    def state(self) -> State:
        return State(step_count=self.turns)


app = create_app(CountEnv, SayAction, CountObservation, max_concurrent_envs=64)
