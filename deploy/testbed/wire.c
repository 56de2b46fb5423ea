/*
 * A wire with propagation delay, jitter and loss between two TAP devices.
 *
 * The test bed cannot use netem (the project's kernels lack it), so a host's link with delay
 * is two TAP devices, one in the host's network namespace and one on the switch (or router)
 * side, and this process carries Ethernet frames between them: every frame read from one
 * device is written to the other after the link's one-way delay, or dropped with the link's
 * loss probability. Rate limits stay with tc tbf on the devices, ahead of the wire.
 *
 *   wire --a NETNS_PATH:DEVICE --b NETNS_PATH:DEVICE [--delay-us N] [--jitter-us N]
 *        [--loss P] [--seed N] [--queue-bytes N] [--offload 1]
 *
 * The devices are created here (IFF_TAP | IFF_NO_PI, not persistent): they exist exactly as
 * long as this process, so killing it removes both. The process enters namespace A last and
 * stays there, so whoever deletes A's namespace finds and stops it (`ip netns pids`). Once
 * both devices exist it prints "ready" on stdout; it exits 0 on SIGTERM or SIGINT and prints
 * its counters on stderr.
 *
 * Jitter: each direction's extra delay follows a random walk through knots drawn uniformly in
 * [-jitter, +jitter] and placed 2 * jitter apart, linearly interpolated. The delay therefore
 * never changes faster than time passes, so frames leave in the order they came (a FIFO, as a
 * router queue is) and a frame's delay does not depend on how many frames share the link;
 * independent per-frame draws would either reorder frames (netem's default) or, clamped to
 * FIFO order, push every frame of a busy link towards the largest draw.
 *
 * Priority: the wire raises its own (nice WIRE_NICE, where allowed): on a machine whose CPUs
 * are busy, a wire that waits for a CPU would add that wait to every frame's delay, and the
 * link would no longer be what was asked. It spends its time asleep in ppoll.
 *
 * Offload (--offload 1, only for links without loss): both devices take TCP segmentation
 * and checksum offload (IFF_VNET_HDR), so the kernel hands the wire TCP super-frames of
 * several segments, as it hands a veth, and the wire carries each with its virtio header
 * untouched to the other device: several times fewer frames, and CPU, per byte. A loss
 * would then drop several segments at once, so a lossy link carries single packets.
 *
 * Loss: each frame, in each direction, is dropped independently with probability P.
 * A frame that finds QUEUE_BYTES already waiting in its direction is dropped too (a tail drop,
 * as a router's full buffer does).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME (65536 + 64) /* a 64 KiB super-frame and its virtio header */
/* Frames read from one device per pass before due frames are written again: keeps the
 * release times accurate while a burst arrives. */
#define READ_BATCH 64
#define WIRE_NICE (-10)

struct frame {
    struct frame *next;
    int64_t due_ns;
    size_t len;
    unsigned char data[];
};

struct direction {
    const char *name;
    int in_fd;
    int out_fd;
    struct frame *head;
    struct frame *tail;
    size_t queued_bytes;
    int64_t last_due_ns;
    /* Jitter random walk: value at the previous and the next knot, and the knots' times. */
    int64_t knot_start_ns;
    int64_t knot_value_ns[2];
    uint64_t passed, lost, tail_dropped, write_errors;
};

static volatile sig_atomic_t stop_requested = 0;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static int64_t delay_ns = 0, jitter_ns = 0;
static double loss = 0.0;
static size_t queue_limit = 16u << 20;
static int offload = 0;

static void on_signal(int signum) {
    (void)signum;
    stop_requested = 1;
}

static uint64_t next_random(void) {
    /* xorshift64*: fast, and reproducible from --seed. */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static double uniform01(void) { return (double)(next_random() >> 11) * (1.0 / 9007199254740992.0); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t random_offset(void) { return (int64_t)((uniform01() * 2.0 - 1.0) * (double)jitter_ns); }

/* The extra delay at time t on this direction's random walk (0 without jitter). */
static int64_t jitter_at(struct direction *d, int64_t t) {
    if (jitter_ns <= 0) return 0;
    int64_t spacing = 2 * jitter_ns;
    if (d->knot_start_ns == 0) {
        d->knot_start_ns = t;
        d->knot_value_ns[0] = random_offset();
        d->knot_value_ns[1] = random_offset();
    }
    while (t >= d->knot_start_ns + spacing) {
        d->knot_start_ns += spacing;
        d->knot_value_ns[0] = d->knot_value_ns[1];
        d->knot_value_ns[1] = random_offset();
        if (t >= d->knot_start_ns + 4 * spacing) {  /* idle for long: restart the walk here */
            d->knot_start_ns = t;
        }
    }
    double f = (double)(t - d->knot_start_ns) / (double)spacing;
    return d->knot_value_ns[0] + (int64_t)(f * (double)(d->knot_value_ns[1] - d->knot_value_ns[0]));
}

static int enter_namespace(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "wire: open %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = setns(fd, CLONE_NEWNET);
    if (rc < 0) fprintf(stderr, "wire: setns %s: %s\n", path, strerror(errno));
    close(fd);
    return rc;
}

/* Enter the namespace of "PATH:DEVICE" and create the TAP device DEVICE there. */
static int open_tap(const char *spec) {
    const char *colon = strrchr(spec, ':');
    if (colon == NULL || colon == spec || strlen(colon + 1) == 0 || strlen(colon + 1) >= IFNAMSIZ) {
        fprintf(stderr, "wire: expected NETNS_PATH:DEVICE, got %s\n", spec);
        return -1;
    }
    char path[4096];
    size_t path_len = (size_t)(colon - spec);
    if (path_len >= sizeof(path)) return -1;
    memcpy(path, spec, path_len);
    path[path_len] = '\0';
    if (enter_namespace(path) < 0) return -1;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "wire: open /dev/net/tun: %s\n", strerror(errno));
        return -1;
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0);
    strncpy(ifr.ifr_name, colon + 1, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
        fprintf(stderr, "wire: TUNSETIFF %s in %s: %s\n", colon + 1, path, strerror(errno));
        close(fd);
        return -1;
    }
    if (offload && ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) < 0) {
        fprintf(stderr, "wire: TUNSETOFFLOAD %s in %s: %s\n", colon + 1, path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static void enqueue(struct direction *d, const unsigned char *data, size_t len, int64_t t) {
    if (loss > 0.0 && uniform01() < loss) {
        d->lost++;
        return;
    }
    if (d->queued_bytes + len > queue_limit) {
        d->tail_dropped++;
        return;
    }
    struct frame *f = malloc(sizeof(struct frame) + len);
    if (f == NULL) {
        d->tail_dropped++;
        return;
    }
    int64_t due = t + delay_ns + jitter_at(d, t);
    if (due < d->last_due_ns) due = d->last_due_ns; /* FIFO: never overtake the frame ahead */
    if (due < t) due = t;
    d->last_due_ns = due;
    f->next = NULL;
    f->due_ns = due;
    f->len = len;
    memcpy(f->data, data, len);
    if (d->tail) d->tail->next = f;
    else d->head = f;
    d->tail = f;
    d->queued_bytes += len;
}

/* Write every frame that is due; return the due time of the next one (or -1). */
static int64_t release(struct direction *d, int64_t t) {
    while (d->head && d->head->due_ns <= t) {
        struct frame *f = d->head;
        /* EIO: the device is down (a cut link): the frame is lost, as on a pulled cable. */
        if (write(d->out_fd, f->data, f->len) < 0) d->write_errors++;
        else d->passed++;
        d->head = f->next;
        if (d->head == NULL) d->tail = NULL;
        d->queued_bytes -= f->len;
        free(f);
    }
    return d->head ? d->head->due_ns : -1;
}

/* Read what is waiting on the direction's input; -1 when the device is gone. */
static int drain(struct direction *d, unsigned char *buffer) {
    for (int i = 0; i < READ_BATCH; i++) {
        ssize_t n = read(d->in_fd, buffer, MAX_FRAME);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
            fprintf(stderr, "wire: read %s: %s\n", d->name, strerror(errno));
            return -1;
        }
        if (n == 0) return 0;
        enqueue(d, buffer, (size_t)n, now_ns());
    }
    return 0;
}

static int parse_long(const char *text, long long *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < 0) return -1;
    *out = v;
    return 0;
}

static int usage(void) {
    fprintf(stderr,
            "usage: wire --a NETNS_PATH:DEVICE --b NETNS_PATH:DEVICE [--delay-us N] "
            "[--jitter-us N] [--loss P] [--seed N] [--queue-bytes N] [--offload 0|1]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *spec_a = NULL, *spec_b = NULL;
    long long value = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) return usage();
        const char *flag = argv[i], *arg = argv[++i];
        if (strcmp(flag, "--a") == 0) spec_a = arg;
        else if (strcmp(flag, "--b") == 0) spec_b = arg;
        else if (strcmp(flag, "--delay-us") == 0 && parse_long(arg, &value) == 0) delay_ns = value * 1000;
        else if (strcmp(flag, "--jitter-us") == 0 && parse_long(arg, &value) == 0) jitter_ns = value * 1000;
        else if (strcmp(flag, "--queue-bytes") == 0 && parse_long(arg, &value) == 0 && value > 0)
            queue_limit = (size_t)value;
        else if (strcmp(flag, "--offload") == 0 && parse_long(arg, &value) == 0 && value <= 1)
            offload = (int)value;
        else if (strcmp(flag, "--seed") == 0 && parse_long(arg, &value) == 0)
            rng_state ^= (uint64_t)value * 0x9E3779B97F4A7C15ull + 1;
        else if (strcmp(flag, "--loss") == 0) {
            char *end = NULL;
            loss = strtod(arg, &end);
            if (end == arg || *end != '\0' || !(loss >= 0.0 && loss <= 1.0)) return usage();
        } else return usage();
    }
    if (spec_a == NULL || spec_b == NULL) return usage();
    if (jitter_ns > delay_ns) {
        fprintf(stderr, "wire: jitter must not exceed the delay\n");
        return 2;
    }

    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = on_signal;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    signal(SIGPIPE, SIG_IGN);
    (void)setpriority(PRIO_PROCESS, 0, WIRE_NICE); /* best effort: see the top of this file */

    /* B first, A last: the process stays in A's namespace (see the top of this file). */
    int fd_b = open_tap(spec_b);
    if (fd_b < 0) return 1;
    int fd_a = open_tap(spec_a);
    if (fd_a < 0) return 1;
    printf("ready\n");
    fflush(stdout);

    struct direction dirs[2];
    memset(dirs, 0, sizeof(dirs));
    dirs[0].name = "a->b";
    dirs[0].in_fd = fd_a;
    dirs[0].out_fd = fd_b;
    dirs[1].name = "b->a";
    dirs[1].in_fd = fd_b;
    dirs[1].out_fd = fd_a;
    unsigned char *buffer = malloc(MAX_FRAME);
    if (buffer == NULL) return 1;

    int status = 0;
    while (!stop_requested) {
        int64_t t = now_ns();
        int64_t next = -1;
        for (int k = 0; k < 2; k++) {
            int64_t due = release(&dirs[k], t);
            if (due >= 0 && (next < 0 || due < next)) next = due;
        }
        struct pollfd fds[2] = {{fd_a, POLLIN, 0}, {fd_b, POLLIN, 0}};
        struct timespec timeout, *timeout_p = NULL;
        if (next >= 0) {
            int64_t wait = next - now_ns();
            if (wait < 0) wait = 0;
            timeout.tv_sec = wait / 1000000000;
            timeout.tv_nsec = wait % 1000000000;
            timeout_p = &timeout;
        }
        int ready = ppoll(fds, 2, timeout_p, NULL);
        if (ready < 0) {
            if (errno == EINTR) continue;
            perror("wire: ppoll");
            status = 1;
            break;
        }
        for (int k = 0; k < 2; k++) {
            if (fds[k].revents & (POLLERR | POLLNVAL)) {
                fprintf(stderr, "wire: device %s failed\n", k == 0 ? "a" : "b");
                stop_requested = 1;
                status = 1;
            } else if ((fds[k].revents & POLLIN) && drain(&dirs[k], buffer) < 0) {
                stop_requested = 1;
                status = 1;
            }
        }
    }
    for (int k = 0; k < 2; k++) {
        fprintf(stderr,
                "wire %s: passed %llu lost %llu tail_dropped %llu write_errors %llu\n",
                dirs[k].name, (unsigned long long)dirs[k].passed, (unsigned long long)dirs[k].lost,
                (unsigned long long)dirs[k].tail_dropped, (unsigned long long)dirs[k].write_errors);
    }
    return status;
}
