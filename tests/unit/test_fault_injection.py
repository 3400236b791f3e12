"""FaultInjector: each planned point raises once, at its N-th pass; a bad plan is refused at load naming
the `fault_injection` key; the shipped configs plan no fault."""

import pytest

from batchlm.errors import InvalidArgument
from batchlm.backend.fault_injection import REQUEST_LEVEL_POINTS, FaultInjector, InjectedFault, InjectedThreadDeath
from batchlm.backend.serving_config import ServingConfig


def test_each_point_raises_once_at_its_pass():
    faults = FaultInjector.parse("step@2, metrics@1,loop@1")
    faults.hit("admit")  # not planned: never raises
    faults.hit("step")
    with pytest.raises(InjectedFault, match="step, pass 2"):
        faults.hit("step")
    faults.hit("step")  # once only
    with pytest.raises(InjectedFault):
        faults.hit("metrics")
    with pytest.raises(InjectedThreadDeath):  # not an Exception: nothing in the loop catches it
        faults.hit("loop")
    assert not issubclass(InjectedThreadDeath, Exception)


@pytest.mark.parametrize("spec", ["step", "step@0", "step@x", "nowhere@1", "step@1,step@2"])
def test_a_bad_plan_is_refused_naming_the_key(spec):
    with pytest.raises(InvalidArgument) as err:
        ServingConfig.from_parameters({"fault_injection": spec})
    assert err.value.field == "fault_injection"


def test_no_plan_is_no_fault():
    assert ServingConfig.from_parameters({}).fault_injection == ""
    FaultInjector.parse("").hit("step")


def test_a_point_the_model_does_not_have_is_refused_naming_the_key():
    """static and dynamic batching have no `abort`: their services parse the plan with their own points."""
    with pytest.raises(InvalidArgument) as err:
        FaultInjector.parse("step@2,abort@1", points=REQUEST_LEVEL_POINTS)
    assert err.value.field == "fault_injection" and "'abort@1'" in str(err.value)
    assert FaultInjector.parse("admit@1,step@1,metrics@1,loop@1", points=REQUEST_LEVEL_POINTS).plan["loop"] == 1
