package main

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sirupsen/logrus"
)

// eventInstanceStateChanged is a state change of an instance, in the outbox,
// so the stream clients of every instance watch it become ready and drain.
const eventInstanceStateChanged = "instance.state_changed"

// lifecycleFeature declares the lifecycle's own event; recordStateChanges
// (phase 13) writes it.
func lifecycleFeature() feature {
	return feature{name: "lifecycle", publishes: []string{eventInstanceStateChanged}}
}

// stateChanged is the payload of instance.state_changed.
type stateChanged struct {
	InstanceID string `json:"instanceId"`
	From       string `json:"from"`
	To         string `json:"to"`
}

// recordStateChanges is a state-change observer (Lifecycle.OnStateChange)
// that writes every change but the last as an outbox event. Stopped is not
// recorded: the pool is closed then. A state change must never hang on the
// database: it waits at most timeout (timeouts.stateRecord). One statement,
// its own transaction: a slow shared database costs the drain one round
// trip, not three (BEGIN, INSERT, COMMIT), and its draining event is kept.
func recordStateChanges(db *pgxpool.Pool, instanceID string, timeout time.Duration, log *logrus.Entry) func(from, to State) {
	return func(from, to State) {
		if to == StateStopped {
			return
		}
		sc := stateChanged{InstanceID: instanceID, From: from.String(), To: to.String()}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if _, err := writeOutboxEvent(ctx, db, "instance", sc.InstanceID, eventInstanceStateChanged, sc); err != nil {
			log.WithError(err).Warn("recording the state change")
		}
	}
}
