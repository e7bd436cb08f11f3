package main

import (
	"fmt"

	"github.com/sirupsen/logrus"
)

// component is one part of the process that has a name an operator sees: a
// listener, a dependency's client, a background loop. Its name is declared
// once, in components below, and everything else derives from it: the log
// field component=<name>, kumiko_panics_total{component}, the connect target,
// the heartbeat worker, the readiness check of a gating heartbeat and the
// drain step of its shutdown hook. A name that is typed twice drifts.
type component int

// In boot order, roughly: the order is the table's, nothing depends on it.
const (
	componentOps             component = iota // the ops listener (probes, metrics, admin)
	componentReadinessChecks                  // the readiness checks' background loops
	componentDB                               // the PostgreSQL pool
	componentRedis                            // the Redis client
	componentClusterStatus                    // this instance's record for the cluster dashboard
	componentHeartbeats                       // this instance's heartbeat keys (cleared on a clean stop)
	componentSearch                           // the Meilisearch client
	componentStorage                          // the S3 client
	componentJobsWorker                       // the River client working jobs
	componentOutboxPoller                     // the outbox poller
	componentJobsHeartbeat                    // the loop beating for the jobs worker (River's loops are River's)
	componentJobsBacklog                      // the loop counting the jobs that wait (backlog.go)
	componentScheduler                        // the cron scheduler, on the leader
	componentLeaderElection                   // the leader elector
	componentSSEHub                           // the event stream hub
	componentAPI                              // the API listener
	componentStateObserver                    // the state-change observers (Lifecycle.OnStateChange)
	componentDiagnostics                      // the flight recorder and what a drain that went wrong leaves behind

	numComponents
)

// componentSpec is what a component's name is used for.
type componentSpec struct {
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

// components is indexed by component; its length makes the compiler refuse a
// component without an entry.
var components = [numComponents]componentSpec{
	componentOps:             {name: "ops"},
	componentReadinessChecks: {name: "readinessChecks"},
	componentDB:              {name: "db", connects: true},
	componentRedis:           {name: "redis", connects: true},
	componentClusterStatus:   {name: "clusterStatus"},
	componentHeartbeats:      {name: "heartbeats"},
	componentSearch:          {name: "search"},
	componentStorage:         {name: "storage"},
	componentJobsWorker:      {name: "jobsWorker", heartbeat: "jobs", gates: true, connects: true},
	componentOutboxPoller:    {name: "outboxPoller", heartbeat: "outbox", gates: true, connects: true},
	componentJobsHeartbeat:   {name: "jobsHeartbeat"},
	componentJobsBacklog:     {name: "jobsBacklog"},
	componentScheduler:       {name: "scheduler", heartbeat: "scheduler"},
	componentLeaderElection:  {name: "leaderElection", connects: true},
	componentSSEHub:          {name: "sseHub"},
	componentAPI:             {name: "api"},
	componentStateObserver:   {name: "stateObserver"},
	componentDiagnostics:     {name: "diagnostics"},
}

func (c component) spec() componentSpec { return components[c] }

func (c component) String() string {
	if c < 0 || c >= numComponents {
		return fmt.Sprintf("component(%d)", int(c))
	}
	return components[c].name
}

// log is the logger of the component's lines: every one carries its name.
func (c component) log(l *logrus.Logger) *logrus.Entry {
	return l.WithField("component", c.String())
}
