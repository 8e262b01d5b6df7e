"""AReaL's RLVRWorkflow with this repo's system message (when it has one) in front of every prompt."""

from areal.workflow.rlvr import RLVRWorkflow


class HintedWorkflow(RLVRWorkflow):
    def __init__(self, system_prompt: str, **kwargs) -> None:
        def with_system(data: dict):
            system = [{"role": "system", "content": system_prompt}] if system_prompt else []
            return [*system, *data["messages"]]

        super().__init__(data_extract_prompt_fn=with_system, **kwargs)
