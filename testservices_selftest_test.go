package main

// Self-tests for testservices_test.go: they prove the helpers hand out real,
// isolated servers, so a failure here points at the test environment rather
// than at application code.

import (
	"bytes"
	"context"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/redis/go-redis/v9"
)

func TestTestPostgresGivesSeparateEmptyDatabases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	first, second := testPostgres(t), testPostgres(t)
	if first == second {
		t.Fatalf("two calls returned the same database URL %q", first)
	}

	connFirst := connectPostgres(t, first)
	connSecond := connectPostgres(t, second)
	for _, conn := range []*pgx.Conn{connFirst, connSecond} {
		var tables int
		err := conn.QueryRow(ctx,
			`SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'`).Scan(&tables)
		if err != nil {
			t.Fatalf("counting tables: %v", err)
		}
		if tables != 0 {
			t.Errorf("database %s has %d tables, want an empty database", conn.Config().Database, tables)
		}
	}

	// A table created in one database must not show up in the other.
	if _, err := connFirst.Exec(ctx, `CREATE TABLE only_in_first (id int)`); err != nil {
		t.Fatalf("creating table: %v", err)
	}
	var exists bool
	if err := connSecond.QueryRow(ctx, `SELECT to_regclass('only_in_first') IS NOT NULL`).Scan(&exists); err != nil {
		t.Fatalf("looking for table: %v", err)
	}
	if exists {
		t.Error("table created in the first database is visible in the second")
	}
}

func TestTestPostgresDropsDatabaseOnCleanup(t *testing.T) {
	t.Parallel()
	var dbURL string
	t.Run("user", func(t *testing.T) {
		dbURL = testPostgres(t)
		// A connection left open must not block the drop (WITH (FORCE)).
		connectPostgresNoCleanup(t, dbURL)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, dbURL); err == nil {
		conn.Close(ctx)
		t.Fatalf("database %s still exists after its test finished", dbURL)
	} else if !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("connecting to dropped database: got %v, want a \"does not exist\" error", err)
	}
}

func connectPostgres(t *testing.T, dbURL string) *pgx.Conn {
	t.Helper()
	conn := connectPostgresNoCleanup(t, dbURL)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func connectPostgresNoCleanup(t *testing.T, dbURL string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatalf("connecting to %s: %v", dbURL, err)
	}
	if err := conn.Ping(ctx); err != nil {
		t.Fatalf("pinging %s: %v", dbURL, err)
	}
	return conn
}

func TestTestRedisStopAndStartOnSamePort(t *testing.T) {
	t.Parallel()
	srv := testRedis(t)
	opts, err := redis.ParseURL(srv.URL)
	if err != nil {
		t.Fatalf("parsing %q: %v", srv.URL, err)
	}
	if opts.Addr != srv.Addr {
		t.Fatalf("URL %q points at %s, but Addr is %s", srv.URL, opts.Addr, srv.Addr)
	}
	opts.MaxRetries = -1
	opts.DialerRetries = 1
	opts.DialTimeout = time.Second
	client := redis.NewClient(opts)
	t.Cleanup(func() { client.Close() })
	ping := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return client.Ping(ctx).Err()
	}

	if err := ping(); err != nil {
		t.Fatalf("PING before Stop: %v", err)
	}
	srv.Stop()
	if err := ping(); err == nil {
		t.Fatal("PING succeeded after Stop")
	}
	srv.Stop() // idempotent
	srv.Start()
	if err := ping(); err != nil {
		t.Fatalf("PING after Start: %v", err)
	}
	if got, _ := redis.ParseURL(srv.URL); got.Addr != opts.Addr {
		t.Errorf("address changed across restart: %s -> %s", opts.Addr, got.Addr)
	}
}

func TestTestRedisServersAreIndependent(t *testing.T) {
	t.Parallel()
	if os.Getenv("TEST_REDIS_URL") != "" {
		t.Skip("TEST_REDIS_URL: every testRedis call returns the same external server")
	}
	a, b := testRedis(t), testRedis(t)
	if a.Addr == b.Addr {
		t.Fatalf("two servers share address %s", a.Addr)
	}
	ctx := context.Background()
	ca := redis.NewClient(&redis.Options{Addr: a.Addr})
	cb := redis.NewClient(&redis.Options{Addr: b.Addr})
	t.Cleanup(func() { ca.Close(); cb.Close() })
	if err := ca.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if n, err := cb.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Fatalf("EXISTS on the other server = %d, %v; want 0, nil", n, err)
	}
}

func TestTestS3BucketAndObjectRoundTrip(t *testing.T) {
	t.Parallel()
	srv := testS3(t)
	client, err := minio.New(srv.Endpoint, &minio.Options{
		Creds: credentials.NewStaticV4(srv.AccessKey, srv.SecretKey, ""),
	})
	if err != nil {
		t.Fatalf("creating S3 client: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	const bucket, key = "kumiko-selftest", "dir/hello.txt"
	body := []byte("hello from the test helper")
	if err := client.MakeBucket(ctx, bucket, minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("MakeBucket: %v", err)
	}
	_, err = client.PutObject(ctx, bucket, key, bytes.NewReader(body), int64(len(body)),
		minio.PutObjectOptions{ContentType: "text/plain"})
	if err != nil {
		t.Fatalf("PutObject: %v", err)
	}
	obj, err := client.GetObject(ctx, bucket, key, minio.GetObjectOptions{})
	if err != nil {
		t.Fatalf("GetObject: %v", err)
	}
	defer obj.Close()
	got, err := io.ReadAll(obj)
	if err != nil {
		t.Fatalf("reading object: %v", err)
	}
	if !bytes.Equal(got, body) {
		t.Fatalf("object body = %q, want %q", got, body)
	}
}

func TestFreeTCPAddrIsLoopback(t *testing.T) {
	t.Parallel()
	addr := freeTCPAddr(t)
	if !strings.HasPrefix(addr, "127.0.0.1:") || strings.HasSuffix(addr, ":0") {
		t.Fatalf("freeTCPAddr() = %q, want 127.0.0.1:<non-zero port>", addr)
	}
}
