package main

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// A hard stop that overran its slice fails the drain only while a job was
// still at work; River's own services (its leader resigning, its completer)
// stopping late is best effort.
func TestHardStopFailedOnlyWithAJobAtWork(t *testing.T) {
	overran := context.DeadlineExceeded
	var be *bestEffortError
	if err := hardStopFailed(overran, 1); errors.As(err, &be) || !strings.Contains(err.Error(), "1 still running") {
		t.Errorf("with a job at work: %v; want a failure naming it", err)
	}
	if err := hardStopFailed(overran, 0); !errors.As(err, &be) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("with no job at work: %v; want a best-effort failure", err)
	}
}
