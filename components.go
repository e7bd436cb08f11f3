package main

import (
	"github.com/sirupsen/logrus"
)

// component is one part of the process that has a name an operator sees: a
// listener, a dependency's client, a background loop. It is declared once,
// where it lives — the core's below, a building block's in the block's own
// file (componentOutboxPoller in outbox.go, …) — and everything else derives
// from it: the log field component=<name>, kumiko_panics_total{component},
// the connect target, the heartbeat worker, the readiness check of a gating
// heartbeat and the drain step of its shutdown hook. A name that is typed
// twice drifts. The root lists the blocks' (blockComponents in app.go), so
// their series start at 0 with the core's.
type component struct {
	// name is the log field component=<name>, the panics label, the connect
	// target and the shutdown hook's drain step.
	name string
	// heartbeat is the worker part of its heartbeat key (redis.go) and the
	// kumiko_worker_heartbeats_total{worker} label; "" when it writes none.
	// Other instances read these keys: keep the values (docs/redis-keys.md).
	heartbeat string
	// gates: a stale heartbeat fails readiness, under the check <name>.
	gates bool
	// connects: its boot phase connects with retries (retry.go), counted in
	// kumiko_connect_attempts_total{target=<name>}.
	connects bool
}

// The core's components, in boot order.
var (
	componentOps             = component{name: "ops"}                // the ops listener (probes, metrics, admin)
	componentReadinessChecks = component{name: "readinessChecks"}    // the readiness checks' background loops
	componentDB              = component{name: "db", connects: true} // the PostgreSQL pool
	componentAPI             = component{name: "api"}                // the API listener
	componentStateObserver   = component{name: "stateObserver"}      // the state-change observers (Lifecycle.OnStateChange)
	componentDiagnostics     = component{name: "diagnostics"}        // the flight recorder and what a drain that went wrong leaves behind
)

// coreComponents lists the core's components, for the series that start at 0.
func coreComponents() []component {
	return []component{componentOps, componentReadinessChecks, componentDB, componentAPI, componentStateObserver, componentDiagnostics}
}

func (c component) String() string { return c.name }

// log is the logger of the component's lines: every one carries its name.
func (c component) log(l *logrus.Logger) *logrus.Entry {
	return l.WithField("component", c.String())
}
