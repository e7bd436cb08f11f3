package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

const usage = `usage: kumiko-lifecycle-demo [command]

commands:
  serve               boot, serve, drain on SIGTERM (default)
  migrate up          apply every pending migration
  migrate down N      roll back N migrations
  migrate status      show the schema version and what is pending
  migrate force N     mark the schema as being at version N (after repairing a failed migration)
  workers             list the live workers of every instance (Redis heartbeats)
  healthcheck         exit 0 when the local /health/ready answers 200 (for Docker HEALTHCHECK)
  settings            print every setting: its environment name, file key, default and what it accepts
  version             print the version`

// run is the whole program: everything the OS gives is an argument, so tests
// call it directly. environ is the environment as "NAME=value" lines (as
// os.Environ gives it): getenv reads it, environ lists it, so the config can
// refuse a KUMIKO_ variable no setting reads.
func run(ctx context.Context, args []string, getenv func(string) string, environ []string, stdout, stderr io.Writer) error {
	command := "serve"
	if len(args) > 1 {
		command = args[1]
	}
	switch command {
	case "serve":
		return newApp(getenv, environ, stdout).serve(ctx)
	case "migrate":
		return runMigrate(ctx, args[2:], getenv, environ, stdout)
	case "workers":
		return runWorkers(ctx, getenv, environ, stdout)
	case "healthcheck":
		return runHealthcheck(ctx, getenv)
	case "settings":
		_, err := io.WriteString(stdout, configReference())
		return err
	case "version":
		fmt.Fprintln(stdout, serviceName, version)
		return nil
	case "help", "-h", "--help":
		fmt.Fprintln(stdout, usage)
		return nil
	default:
		return fmt.Errorf("unknown command %q\n%s", command, usage)
	}
}

// runMigrate is `migrate up|down N|status`: the same embedded migrations the
// boot checks, for operators who run them as a separate deploy step.
func runMigrate(ctx context.Context, args []string, getenv func(string) string, environ []string, stdout io.Writer) error {
	cfg, err := loadConfig(getenv, environ, os.ReadFile)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("connecting to the database: %w", err)
	}
	defer pool.Close()
	mg, err := newMigrator(pool, newTimeouts(cfg).phase)
	if err != nil {
		return err
	}
	defer mg.Close()

	switch {
	case len(args) == 1 && args[0] == "up":
		err = mg.up(ctx)
	case len(args) == 2 && args[0] == "down":
		n, convErr := strconv.Atoi(args[1])
		if convErr != nil || n < 1 {
			return fmt.Errorf("migrate down takes a positive number of steps, got %q", args[1])
		}
		err = mg.down(ctx, n)
	case len(args) == 2 && args[0] == "force":
		v, convErr := strconv.Atoi(args[1])
		if convErr != nil || v < -1 {
			return fmt.Errorf("migrate force takes a version number (-1: nothing applied), got %q", args[1])
		}
		err = mg.force(v)
	case len(args) == 1 && args[0] == "status":
	default:
		return fmt.Errorf("usage: migrate up | migrate down N | migrate force N | migrate status")
	}
	if err != nil {
		return err
	}
	st, err := mg.status()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "version %d (dirty %t), binary has %d, pending %v\n", st.Version, st.Dirty, st.Latest, st.Pending)
	return nil
}

// runWorkers lists every live worker of every instance from the heartbeat keys.
func runWorkers(ctx context.Context, getenv func(string) string, environ []string, stdout io.Writer) error {
	cfg, err := loadConfig(getenv, environ, os.ReadFile)
	if err != nil {
		return err
	}
	opts, err := redis.ParseURL(cfg.Redis.URL)
	if err != nil {
		return fmt.Errorf("parsing REDIS_URL: %w", err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	workers, err := listLiveWorkers(ctx, rdb)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKER\tINSTANCE\tAGE")
	for _, w := range workers {
		fmt.Fprintf(tw, "%s\t%s\t%ds\n", w.Worker, w.InstanceID, w.AgeSec)
	}
	return tw.Flush()
}

// runHealthcheck asks the local ops listener for readiness. It reads only
// KUMIKO_OPS_ADDR: a health check must not fail because of unrelated config.
func runHealthcheck(ctx context.Context, getenv func(string) string) error {
	addr := getenv("KUMIKO_OPS_ADDR")
	if addr == "" {
		addr = ":9090"
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("KUMIKO_OPS_ADDR %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1" // bound on every interface: loopback reaches it
	}
	ctx, cancel := context.WithTimeout(ctx, healthcheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(host, port)+"/health/ready", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("readiness probe: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errors.New("not ready: " + resp.Status)
	}
	return nil
}
