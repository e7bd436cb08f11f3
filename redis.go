package main

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// connectRedis is phase 10: the go-redis client, retried with the same backoff as the DB.
func (a *app) connectRedis(ctx context.Context, p *phaseRun) error {
	opts, err := redis.ParseURL(a.cfg.RedisURL)
	if err != nil {
		return fmt.Errorf("parsing REDIS_URL: %w", err)
	}
	opts.ClientName = serviceName + "/" + a.cfg.InstanceID
	// Let a cancelled context interrupt a command stuck on the socket: a hard
	// stop must not wait for Redis's read timeout.
	opts.ContextTimeoutEnabled = true
	client := redis.NewClient(opts)
	ping := func(ctx context.Context) error { return client.Ping(ctx).Err() }
	if err := a.connectWithRetry(ctx, p, "redis", ping); err != nil {
		client.Close()
		return err
	}
	a.redis = client
	a.redisNow.Store(client)
	a.lc.RegisterShutdownHook("redis", func(context.Context) error { return client.Close() })
	a.health.RegisterReadinessCheck("redis", true, func(ctx context.Context) checkResult {
		return timedCheck(ctx, ping)
	})
	// Heartbeat keys live in Redis. Their hook is registered after the client's,
	// so LIFO deletes them after the workers stop and before the client closes.
	a.heartbeats = newHeartbeats(client, a.cfg.InstanceID, a.cfg.Lifecycle.Heartbeat.TTL, a.metrics, a.health)
	a.lc.RegisterShutdownHook("heartbeats", a.heartbeats.clear)
	return nil
}
