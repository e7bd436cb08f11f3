package main

import (
	"context"
	"sync"

	"github.com/sirupsen/logrus"
)

// Event types published on the in-process bus.
const eventStateChanged = "lifecycle.state.changed"

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
