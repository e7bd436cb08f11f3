package main

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sirupsen/logrus"
)

// Event types: lifecycle.state.changed on the in-process bus;
// instance.state_changed is its durable twin in the outbox, for SSE clients.
const (
	eventStateChanged         = "lifecycle.state.changed"
	eventInstanceStateChanged = "instance.state_changed"
)

// event is one in-process event. Durable, cross-instance events go through the
// outbox instead; this bus is for reacting inside the process.
type event struct {
	Type    string
	Payload any
}

// stateChanged is the payload of lifecycle.state.changed.
type stateChanged struct {
	InstanceID string `json:"instanceId"`
	From       string `json:"from"`
	To         string `json:"to"`
}

// eventBus delivers events synchronously to the subscribers of their type. A
// panicking subscriber is logged and counted; it does not stop the others.
type eventBus struct {
	log     *logrus.Entry
	metrics *metrics

	mu       sync.RWMutex
	handlers map[string][]func(context.Context, event)
}

func newEventBus(log *logrus.Logger, m *metrics) *eventBus {
	return &eventBus{log: log.WithField("component", "events"), metrics: m, handlers: map[string][]func(context.Context, event){}}
}

func (b *eventBus) subscribe(eventType string, fn func(context.Context, event)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.handlers[eventType] = append(b.handlers[eventType], fn)
}

func (b *eventBus) publish(ctx context.Context, ev event) {
	b.mu.RLock()
	handlers := b.handlers[ev.Type]
	b.mu.RUnlock()
	for _, fn := range handlers {
		b.deliver(ctx, ev, fn)
	}
}

func (b *eventBus) deliver(ctx context.Context, ev event, fn func(context.Context, event)) {
	defer func() {
		if r := recover(); r != nil {
			b.metrics.panics.WithLabelValues("events").Inc()
			b.log.WithFields(logrus.Fields{"event": ev.Type, "panic": r}).Error("subscriber panicked")
		}
	}()
	fn(ctx, ev)
}

// recordStateChanges is the demo's reaction to lifecycle.state.changed: an
// outbox event, so the SSE clients of every instance watch this one become
// ready and start draining. Stopped is not recorded: the pool is closed then.
// A state change must never hang on the database: it waits at most timeout
// (a request's budget).
func recordStateChanges(db *pgxpool.Pool, timeout time.Duration, log *logrus.Entry) func(context.Context, event) {
	return func(ctx context.Context, ev event) {
		sc, ok := ev.Payload.(stateChanged)
		if !ok || sc.To == StateStopped.String() {
			return
		}
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			_, err := writeOutboxEvent(ctx, tx, "instance", sc.InstanceID, eventInstanceStateChanged, sc)
			return err
		})
		if err != nil {
			log.WithError(err).Warn("recording the state change")
		}
	}
}
