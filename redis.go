package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// componentRedis is the Redis client.
var componentRedis = component{name: "redis", connects: true}

// redisConfig is the Redis block's setting.
type redisConfig struct{ URL string }

func (c *redisConfig) settings() []configSetting {
	return []configSetting{
		{key: "redis.url", env: "REDIS_URL", value: urlValue{p: &c.URL, schemes: []string{"redis", "rediss", "unix"}},
			doc: "redis://host:6379/0", required: true},
	}
}

// Every Redis key and channel of this service, in one list: all of them sit
// under redisKeyPrefix, so two services sharing one Redis never share a lock,
// a heartbeat or an event channel.
const (
	eventsChannel          = redisKeyPrefix + "events"              // pub/sub: every delivered event, for every instance's stream hub
	leaderKey              = redisKeyPrefix + "leader"              // value: "<instanceId>:<fencing token>"
	leaderTokenKey         = redisKeyPrefix + "leader:fencing"      // INCR on every acquisition
	leaderReleased         = redisKeyPrefix + "leader:released"     // pub/sub: the leader stepped down, try now
	heartbeatKeyPrefix     = redisKeyPrefix + "heartbeat:"          // + <worker>:<instanceId>
	outboxPollersKey       = redisKeyPrefix + "outbox:pollers"      // sorted set: live outbox pollers by entry expiry (unix ms)
	outboxRebalanceChannel = redisKeyPrefix + "outbox:rebalance"    // pub/sub: a poller joined or left, take your new share
	statusKeyPrefix        = redisKeyPrefix + "dashboard:instance:" // + <instanceId>: the dashboard's record of one instance
	statusIndexKey         = redisKeyPrefix + "dashboard:instances" // sorted set: instance id by record expiry (unix ms)
	// demo:begin (the orders demo's key; scripts/new-service.sh --bare removes this block)
	idempotencyKeyPrefix = redisKeyPrefix + "idempotency:" // + the client's Idempotency-Key
	// demo:end
)

// compareAndDelete deletes KEYS[1] only while it still holds ARGV[1]: the
// release of something this process holds (the leader lock, a feature's
// lease) must never delete what another holder took after it expired.
var compareAndDelete = redis.NewScript(`if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("DEL", KEYS[1])
end
return 0`)

// redisClient is phase 10's first step (boot.go): the go-redis client,
// retried with the same backoff as the DB.
func (a *app) redisClient(ctx context.Context, p *phaseRun) error {
	opts, err := redis.ParseURL(a.cfg.Redis.URL)
	if err != nil {
		return fmt.Errorf("parsing REDIS_URL: %w", err)
	}
	opts.ClientName = serviceName + "/" + a.cfg.InstanceID
	// Let a cancelled context interrupt a command stuck on the socket: a hard
	// stop must not wait for Redis's read timeout.
	opts.ContextTimeoutEnabled = true
	// go-redis logs (pool dial failures, dropped pub/sub connections) through
	// one package-wide logger; route it through ours so those lines are
	// structured and scrubbed too. One process has one app, so setting it here
	// is safe; in a test running two apps in one process the last one wins.
	redis.SetLogger(redisLogger{log: componentRedis.log(a.log)})
	a.redisOpts = opts // NewClient copies them: they stay as parsed
	client := redis.NewClient(opts)
	ping := func(ctx context.Context) error { return client.Ping(ctx).Err() }
	if err := a.connectWithRetry(ctx, p, componentRedis, ping); err != nil {
		client.Close()
		return err
	}
	a.redis = client
	a.lc.RegisterShutdownHook(componentRedis, func(context.Context) error { return client.Close() })
	// Redis is shown, never gating: every instance shares it, and the core
	// path works without it (health.go).
	a.health.RegisterReadinessCheck(componentRedis.String(), false, func(ctx context.Context) checkResult {
		return timedCheck(ctx, ping)
	})
	return nil
}

// redisLogger is go-redis's logger interface (Printf) on the process logger.
// go-redis only logs trouble, so every line is a warning.
type redisLogger struct{ log *logrus.Entry }

func (l redisLogger) Printf(_ context.Context, format string, v ...any) {
	l.log.Warn(strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: "))
}
